"""The run: the launcher, the job on each rank, the Trainer it builds, the step loop and the passes
of one step, the parts that act around each step, and stopping."""
