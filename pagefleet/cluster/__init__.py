"""The Ray Serve application and the `pagefleet` command."""
