"""Records → pages: results.json, the notebook runner and index, the summary cards, figures (no torch), comparisons."""
