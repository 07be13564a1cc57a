"""Statistics of a model taken from texts or from the recent tokens, which policies read instead of attention."""
