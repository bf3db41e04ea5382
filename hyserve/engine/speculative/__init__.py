"""Speculative decoding: drafting (n-gram), verification of a step's drafts, and the Mamba state of the last
accepted token."""
