"""Running a stage's actions: the executor of one (virtual) stage, the two step runners, records, outputs, failures."""
