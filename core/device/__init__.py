"""What a device plugin implements (`backend`) and the device-neutral helpers it
may build on (buckets, KV specs, graph capture). Plugins import these names
through `polyrunner.plugin_api`."""
