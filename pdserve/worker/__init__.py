"""A worker process: its command loop, the commands it carries out, its reports and stats, joining and leaving a
deployment (`pdserve worker --join`), Ray placement, and the control plane's msgpack codec."""
