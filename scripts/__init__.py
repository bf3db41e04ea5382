"""Maintenance scripts (training the needle checkpoints, A/B comparisons); the tests import them as
`scripts.x`."""
