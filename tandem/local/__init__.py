"""The embedded local runtime: a ServingCluster as processes on one machine (`tandem up`)."""
