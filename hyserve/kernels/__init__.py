"""Kernels: one file per op. Each file holds the plain-torch reference (the CPU path and the test oracle)
and, where one exists, the Triton kernel with its launcher. Importing this package never imports triton.
"""
