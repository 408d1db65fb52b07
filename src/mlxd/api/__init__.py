"""HTTP: one router per dialect; dialects translate wire schemas to core types, nothing else."""
