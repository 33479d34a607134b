"""Planning, pure: cache layouts and their byte math, descriptor arrays, heterogeneous pairs, and the
`kv_transfer_params` struct with its one validation. No sockets, no NIXL, no tensors: numpy and msgspec only."""
