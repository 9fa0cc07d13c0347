"""What sweeps and commands share: `prepare` (task -> cache -> teacher -> StudyData) and `distributed` (encoding
sharded over Ray actors, Ray imported only there)."""
