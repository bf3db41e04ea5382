"""Running the model: loading it, turning a scheduled batch into tensors and logits, CUDA graphs for decode,
and watching the device (Triton compilations after ready, allocator retries)."""
