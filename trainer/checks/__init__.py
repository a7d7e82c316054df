"""A job's configuration, composed from the command line and checked before any rank works: the
overrides (a group choice or key that does not exist), the range of each value, the layout on a
world of ranks, and every rule between keys (`checks.job.check_job`, the one entry)."""
