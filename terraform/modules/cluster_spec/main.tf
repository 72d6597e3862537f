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
    runtime_metrics_min = 8000
    runtime_metrics_max = 8100
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
