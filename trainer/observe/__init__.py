"""What a run shows: its metrics and summary, the start-up lines, measured memory and the
allocator's snapshots, the profiler, straggler detection, and comparing two runs' curves."""
