"""What crosses between workers: side-channel messages and notifications (`protocol`), the ZMQ side channel
(`handshake`), and every lease request a client sends (`lease_client`)."""
