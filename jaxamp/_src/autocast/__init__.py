"""autocast: the jaxpr interpreter, its rules and the regions and dataflow facts they read."""
