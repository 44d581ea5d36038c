"""One module per on-disk format: fashion_mnist, cifar, synthetic (in memory), folder (ImageNet
layout), csv (image-caption tables), openclipart, shards (webdataset: location, manifest, seek
index) and shard_sets (the streamed shards' samples and counts); held_out.py splits by key."""
