"""Performance accounting: model FLOPs from a config and the device peak a rank measures."""
