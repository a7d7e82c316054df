"""What can be set: the schema (every key, its type and default), its keys as the command line
spells them, and where the config files live and how Hydra finds them. It imports nothing else of
the trainer; the checks a job passes are in trainer/checks/."""
