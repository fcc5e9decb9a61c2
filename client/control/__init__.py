"""The control side of ptcctl and the client: the cluster connection, the
coordinator of reconfigurations, saving, repair, access and the data position."""
