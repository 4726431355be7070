"""Models written by us in the styles real HSTU/torchrec code uses, with nothing for hstu-export in
them: the test bed for exporting users' own models (not copies of anyone's code)."""
