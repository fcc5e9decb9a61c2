"""The wire both sides speak: the protocol, the sealed channel, the peer
client, keys, the cluster file and the registry. It imports neither the
client nor the daemon's handlers."""
