# The fixture trees are sysfs copies: their `device` links point back up the tree (as in the
# real sysfs), so a directory walk that follows links never ends. Never collect in them.
collect_ignore = ["fixtures"]
