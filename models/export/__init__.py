"""Export of trained checkpoints to other runtimes (ONNX)."""
