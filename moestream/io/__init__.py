"""Reading expert bytes: aligned, locked buffers and the I/O threads that fill them."""
