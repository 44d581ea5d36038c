"""What runs before training: fetch.py (download the built-in sets), prepare.py and
shard_writer.py (`vitscale data prepare`: a folder or CSV -> webdataset shards)."""
