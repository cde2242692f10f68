"""Running a stage's actions: the executor of one chunk, the two step runners, records, outputs and failures."""
