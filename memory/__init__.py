"""What a run needs in memory (the estimate checked before anything loads) and the allocator
setting."""
