"""Schedules as data: each rank's ordered actions, in one registry, checked on a simulator."""
