"""One run: claim its folder, check a resume before the first write, build its objects, write its ending."""
