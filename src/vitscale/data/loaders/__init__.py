"""How batches reach the device: memory.py (the whole set in memory), workers.py (decoded in
DataLoader workers; worker_datasets.py holds what runs in them), stream.py (streamed webdataset
shards, planned by stream_plan.py), captions.py (a labelled set as image-text pairs)."""
