"""The prefill half: the lease table (`lease`) and the answers to decodes' handshakes and lease requests
(`side`). It never imports the decode half."""
