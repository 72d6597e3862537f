################################################################################
# Instance types
################################################################################

locals {
  # GPUs, vCPUs and EFA interfaces of the GPU instance types this platform knows
  # (AWS instance type documentation). efa = 0: the type has no EFA support.
  # A type of an accepted family that is missing here still works: it gets no
  # EFA, no GPU-count check and Ray auto-detects its CPUs.
  instance_types = {
    "p3.2xlarge"    = { gpus = 1, vcpus = 8, efa = 0 }
    "p3.8xlarge"    = { gpus = 4, vcpus = 32, efa = 0 }
    "p3.16xlarge"   = { gpus = 8, vcpus = 64, efa = 0 }
    "p3dn.24xlarge" = { gpus = 8, vcpus = 96, efa = 1 }
    "p4d.24xlarge"  = { gpus = 8, vcpus = 96, efa = 4 }
    "p4de.24xlarge" = { gpus = 8, vcpus = 96, efa = 4 }
    "p5.48xlarge"   = { gpus = 8, vcpus = 192, efa = 32 }
    "p5e.48xlarge"  = { gpus = 8, vcpus = 192, efa = 32 }
    "p5en.48xlarge" = { gpus = 8, vcpus = 192, efa = 16 }
    "g4dn.xlarge"   = { gpus = 1, vcpus = 4, efa = 0 }
    "g4dn.2xlarge"  = { gpus = 1, vcpus = 8, efa = 0 }
    "g4dn.4xlarge"  = { gpus = 1, vcpus = 16, efa = 0 }
    "g4dn.8xlarge"  = { gpus = 1, vcpus = 32, efa = 1 }
    "g4dn.12xlarge" = { gpus = 4, vcpus = 48, efa = 1 }
    "g4dn.16xlarge" = { gpus = 1, vcpus = 64, efa = 1 }
    "g4dn.metal"    = { gpus = 8, vcpus = 96, efa = 1 }
    "g5.xlarge"     = { gpus = 1, vcpus = 4, efa = 0 }
    "g5.2xlarge"    = { gpus = 1, vcpus = 8, efa = 0 }
    "g5.4xlarge"    = { gpus = 1, vcpus = 16, efa = 0 }
    "g5.8xlarge"    = { gpus = 1, vcpus = 32, efa = 1 }
    "g5.12xlarge"   = { gpus = 4, vcpus = 48, efa = 1 }
    "g5.16xlarge"   = { gpus = 1, vcpus = 64, efa = 1 }
    "g5.24xlarge"   = { gpus = 4, vcpus = 96, efa = 1 }
    "g5.48xlarge"   = { gpus = 8, vcpus = 192, efa = 1 }
    "g6.xlarge"     = { gpus = 1, vcpus = 4, efa = 0 }
    "g6.2xlarge"    = { gpus = 1, vcpus = 8, efa = 0 }
    "g6.4xlarge"    = { gpus = 1, vcpus = 16, efa = 0 }
    "g6.8xlarge"    = { gpus = 1, vcpus = 32, efa = 1 }
    "g6.12xlarge"   = { gpus = 4, vcpus = 48, efa = 1 }
    "g6.16xlarge"   = { gpus = 1, vcpus = 64, efa = 1 }
    "g6.24xlarge"   = { gpus = 4, vcpus = 96, efa = 1 }
    "g6.48xlarge"   = { gpus = 8, vcpus = 192, efa = 1 }
    "g6e.xlarge"    = { gpus = 1, vcpus = 4, efa = 0 }
    "g6e.2xlarge"   = { gpus = 1, vcpus = 8, efa = 0 }
    "g6e.4xlarge"   = { gpus = 1, vcpus = 16, efa = 0 }
    "g6e.8xlarge"   = { gpus = 1, vcpus = 32, efa = 1 }
    "g6e.12xlarge"  = { gpus = 4, vcpus = 48, efa = 1 }
    "g6e.16xlarge"  = { gpus = 1, vcpus = 64, efa = 1 }
    "g6e.24xlarge"  = { gpus = 4, vcpus = 96, efa = 2 }
    "g6e.48xlarge"  = { gpus = 8, vcpus = 192, efa = 4 }
  }

  # Pools whose gpus_per_node disagrees with the instance type (checked by a
  # precondition on the pools output, so the message can name the pool).
  gpu_count_mismatches = [
    for name, p in var.pools : "${name}: ${p.instance_type} has ${local.instance_types[p.instance_type].gpus} GPUs, gpus_per_node is ${p.gpus_per_node}"
    if contains(keys(local.instance_types), p.instance_type) && try(local.instance_types[p.instance_type].gpus != p.gpus_per_node, false)
  ]
}

################################################################################
# Ports
################################################################################

locals {
  # One place for the ports Terraform and Ansible must agree on; the network
  # module opens the same set inside the cluster security group.
  ports = {
    ray_gcs             = 6379
    ray_dashboard       = 8265
    ray_client          = 10001
    ray_metrics_export  = 8080
    prometheus          = 9090
    node_exporter       = 9100
    dcgm_exporter       = 9400
    mlflow              = 5000
    grafana             = 3000
    log_shipping        = 2514
    runtime_metrics_min = 8000
    runtime_metrics_max = 8100
    # Ray picks these at random unless pinned; the inventory pins them so the
    # security group can name them.
    ray_node_manager        = 8076
    ray_object_manager      = 8077
    ray_dashboard_agent     = 52365
    ray_dashboard_agent_rpc = 52366
    ray_runtime_env_agent   = 52367
    ray_min_worker          = 10002
    ray_max_worker          = 19999
  }

  # Port ranges the network module opens inside the cluster security group
  # (source: the group itself). NCCL's socket transport uses ephemeral ports.
  security_group_ports = {
    ssh              = { from = 22, to = 22 }
    ray_gcs          = { from = local.ports.ray_gcs, to = local.ports.ray_gcs }
    ray_dashboard    = { from = local.ports.ray_dashboard, to = local.ports.ray_dashboard }
    ray_client       = { from = local.ports.ray_client, to = local.ports.ray_client }
    ray_node_manager = { from = local.ports.ray_node_manager, to = local.ports.ray_object_manager }
    ray_metrics      = { from = local.ports.ray_metrics_export, to = local.ports.ray_metrics_export }
    ray_agents       = { from = local.ports.ray_dashboard_agent, to = local.ports.ray_runtime_env_agent }
    ray_workers      = { from = local.ports.ray_min_worker, to = local.ports.ray_max_worker }
    nccl_ephemeral   = { from = 32768, to = 60999 }
    runtime_metrics  = { from = local.ports.runtime_metrics_min, to = local.ports.runtime_metrics_max }
    prometheus       = { from = local.ports.prometheus, to = local.ports.prometheus }
    node_exporter    = { from = local.ports.node_exporter, to = local.ports.node_exporter }
    dcgm_exporter    = { from = local.ports.dcgm_exporter, to = local.ports.dcgm_exporter }
    mlflow           = { from = local.ports.mlflow, to = local.ports.mlflow }
    grafana          = { from = local.ports.grafana, to = local.ports.grafana }
    log_shipping     = { from = local.ports.log_shipping, to = local.ports.log_shipping }
  }
}

################################################################################
# Nodes
################################################################################

locals {
  head_node_name = "${var.cluster_name}-head"

  pools = {
    for name, p in var.pools : name => {
      instance_type = p.instance_type
      count         = p.count
      gpus_per_node = p.gpus_per_node
      capacity_type = p.capacity_type
      spot          = p.capacity_type == "spot"
      vcpus         = try(local.instance_types[p.instance_type].vcpus, null)
      efa_count     = try(local.instance_types[p.instance_type].efa, 0)
      efa_supported = try(local.instance_types[p.instance_type].efa, 0) > 0
      # e.g. train-a-a100-00, train-a-a100-01: stable names, ASG order-free.
      node_names = [for i in range(p.count) : format("%s-%s-%02d", var.cluster_name, name, i)]
      # Every node advertises its pool, so jobs can pin to a pool:
      # resources_per_worker = { "pool_a100" = 0.001 }.
      ray_resources = merge({ "pool_${name}" = 1 }, p.ray_resources)
    }
  }

  workers = flatten([
    for name in sort(keys(local.pools)) : [
      for node in local.pools[name].node_names : {
        name          = node
        pool          = name
        gpus          = local.pools[name].gpus_per_node
        vcpus         = local.pools[name].vcpus
        efa           = local.pools[name].efa_supported
        spot          = local.pools[name].spot
        ray_resources = local.pools[name].ray_resources
      }
    ]
  ])

  node_names = concat([local.head_node_name], [for w in local.workers : w.name])
  total_gpus = sum([for p in values(local.pools) : p.count * p.gpus_per_node])

  ray_resources = merge(
    { (local.head_node_name) = { "head" = 1 } },
    { for w in local.workers : w.name => w.ray_resources },
  )
}

################################################################################
# Inventory
################################################################################

locals {
  missing_addresses = [for n in local.node_names : n if !contains(keys(var.node_addresses), n)]
  unknown_addresses = [for n in keys(var.node_addresses) : n if !contains(local.node_names, n)]
  has_addresses     = length(var.node_addresses) > 0

  head_address = lookup(var.node_addresses, local.head_node_name, "")

  inventory = !local.has_addresses ? null : templatefile("${path.module}/templates/inventory.yml.tftpl", {
    cluster_name      = var.cluster_name
    ssh_user          = var.ssh_user
    head_name         = local.head_node_name
    head_address      = local.head_address
    head_public       = var.head_public_address
    head_resources    = local.ray_resources[local.head_node_name]
    workers           = [for w in local.workers : merge(w, { address = lookup(var.node_addresses, w.name, "") })]
    ports             = local.ports
    checkpoint_bucket = var.checkpoint_bucket
    shared_filesystem = var.shared_filesystem
    # ProxyJump through the head's public address when the controller cannot
    # reach private addresses; StrictHostKeyChecking=accept-new pins keys on first use.
    proxy_args = var.head_public_address == null ? null : "-o ProxyJump=${var.ssh_user}@${var.head_public_address} -o StrictHostKeyChecking=accept-new"
  })
}
