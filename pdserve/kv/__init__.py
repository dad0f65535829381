"""KV tensors: the device pool now; host/disk tiers and codecs join with the tiering work."""
