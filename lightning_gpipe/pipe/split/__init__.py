"""How a backbone is cut: stages and virtual stages, layer indexing, and what a stage may hold or pass on."""
