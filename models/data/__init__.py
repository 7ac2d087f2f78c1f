"""Datasets: the generated-scene dataset and the Karpathy-split JSON loader shared with COCO / Flickr."""
