"""Records → pages: the notebook runner and index, the summary cards, figures (no torch), comparisons."""
