"""Observability: a step's timeline of events, where its time went, and its Gantt chart."""
