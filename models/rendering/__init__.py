"""Rendering of per-word attention onto the image (the heatmap modes)."""
