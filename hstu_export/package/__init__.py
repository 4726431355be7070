"""The package: its directory written atomically, the manifest and its checks, the request schema and ranges, the artifacts' descriptions, signatures, tensors on disk."""
