"""One module per notebook question on one protocol (cases → engine function → records → verdict), and the remedies."""
