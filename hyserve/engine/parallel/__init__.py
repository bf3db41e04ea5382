"""One engine over several ranks: rank 0's runner that tells the others each step, the channel it tells
them over, and starting / joining / watching the ranks."""
