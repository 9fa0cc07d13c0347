"""The adapters and their training on cached vectors: `tensors` (StudyData), `signals` (difficulty targets),
`adapters`, `losses`, `seed_group` (the training loop over a seed group), `metrics`, `retrieval` (the re-ranking
check), `selection` (the winner rule), `diagnostics`, `cascade` (routing), `export` (safetensors + JSON)."""
