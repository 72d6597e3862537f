# `terraform test` for the provider-free cluster description: a good spec
# renders the expected inventory, and every validation rejects bad input.
# Run from terraform/modules/cluster_spec (make tf-check does).

# Global variables: tests/example.auto.tfvars (loaded automatically by
# `terraform test`), the spec behind examples/aws_cluster/inventory.example.yml.

################################################################################
# A good spec
################################################################################

run "good_spec_derives_node_names_and_ray_resources" {
  command = apply

  assert {
    condition     = output.node_names == ["train-a-head", "train-a-a100-00", "train-a-a100-01", "train-a-spot-00"]
    error_message = "node names must be the head, then each pool's nodes numbered from 00: got ${jsonencode(output.node_names)}"
  }

  assert {
    condition     = output.total_gpus == 20
    error_message = "2 x 8 (a100) + 1 x 4 (spot) = 20 GPUs, got ${output.total_gpus}"
  }

  assert {
    condition     = output.ray_resources["train-a-a100-01"] == { "pool_a100" = 1 } && output.ray_resources["train-a-head"] == { "head" = 1 }
    error_message = "every worker advertises pool_<name> and the head advertises head: got ${jsonencode(output.ray_resources)}"
  }

  assert {
    condition     = output.pools["a100"].efa_count == 4 && output.pools["spot"].spot && !output.pools["a100"].spot && output.efa_supported
    error_message = "p4d.24xlarge has 4 EFA interfaces; the spot pool must be marked spot: got ${jsonencode(output.pools)}"
  }
}

run "good_spec_renders_inventory_groups_and_host_vars" {
  command = apply

  assert {
    condition     = join(",", sort(keys(yamldecode(output.inventory).all.children))) == "gpu_workers,head,monitoring"
    error_message = "inventory must have exactly the groups head, gpu_workers, monitoring"
  }

  assert {
    condition     = join(",", keys(yamldecode(output.inventory).all.children.head.hosts)) == "train-a-head" && join(",", keys(yamldecode(output.inventory).all.children.monitoring.hosts)) == "train-a-head"
    error_message = "the head node must be the only host of head and monitoring"
  }

  assert {
    condition     = join(",", sort(keys(yamldecode(output.inventory).all.children.gpu_workers.hosts))) == "train-a-a100-00,train-a-a100-01,train-a-spot-00"
    error_message = "gpu_workers must list every pool node"
  }

  assert {
    condition     = yamldecode(output.inventory).all.vars.ray_head_address == "10.42.0.10:6379"
    error_message = "ray_head_address must be the head's private address and GCS port 6379"
  }

  assert {
    condition = yamldecode(output.inventory).all.children.gpu_workers.hosts["train-a-a100-00"] == {
      ansible_host            = "10.42.1.11"
      ansible_ssh_common_args = "-o ProxyJump=admin@198.51.100.20 -o StrictHostKeyChecking=accept-new"
      ray_node_ip_address     = "10.42.1.11"
      ray_num_gpus            = 8
      ray_num_cpus            = 96
      ray_resources           = { pool_a100 = 1 }
      ray_environment         = { MLFLOW_TRACKING_URI = "http://10.42.0.10:5000", FI_PROVIDER = "efa" }
      nvidia_driver_enabled   = true
    }
    error_message = "host vars of train-a-a100-00 differ from the expected set: ${jsonencode(yamldecode(output.inventory).all.children.gpu_workers.hosts["train-a-a100-00"])}"
  }

  assert {
    condition     = yamldecode(output.inventory).all.children.gpu_workers.hosts["train-a-spot-00"].spot_agent_enabled == true
    error_message = "a spot pool's worker must run the spot agent (spot_agent_enabled: true); on-demand workers carry no such variable (the exact host vars above)"
  }

  assert {
    condition     = yamldecode(output.inventory).all.children.head.hosts["train-a-head"].ray_node_ip_address == "10.42.0.10" && yamldecode(output.inventory).all.children.head.hosts["train-a-head"].ray_num_gpus == 0
    error_message = "the head must advertise its private address to Ray and no GPUs"
  }

  assert {
    condition     = yamldecode(output.inventory).all.children.head.hosts["train-a-head"].ansible_host == "198.51.100.20"
    error_message = "Ansible must reach the head through its public address"
  }

  assert {
    condition     = yamldecode(output.inventory).all.vars.dcgm_exporter_listen_port == 9400 && yamldecode(output.inventory).all.vars.node_exporter_listen_port == 9100 && yamldecode(output.inventory).all.children.monitoring.vars.prometheus_listen_address == "10.42.0.10:9090"
    error_message = "exporter and Prometheus ports must be the ones the security group opens (9400, 9100, 9090)"
  }

  assert {
    condition     = yamldecode(output.inventory).all.children.monitoring.vars.mlflow_host == "10.42.0.10" && !strcontains(output.inventory, "0.0.0.0")
    error_message = "Prometheus and MLflow must bind the head's private address, nothing 0.0.0.0"
  }

  assert {
    condition     = yamldecode(output.inventory).all.children.gpu_workers.hosts["train-a-spot-00"].ray_environment.MLFLOW_TRACKING_URI == "http://10.42.0.10:5000" && yamldecode(output.inventory).all.children.monitoring.vars.mlflow_artifact_root == "s3://train-a-checkpoints/mlflow"
    error_message = "MLflow must run on the head (port 5000) and keep artifacts in the checkpoint bucket"
  }
}

run "inventory_variables_follow_the_role_prefix_convention" {
  command = apply

  assert {
    condition = alltrue([
      for k in concat(
        keys(yamldecode(output.inventory).all.vars),
        keys(yamldecode(output.inventory).all.children.monitoring.vars),
        flatten([for h in values(yamldecode(output.inventory).all.children.gpu_workers.hosts) : keys(h)]),
        keys(yamldecode(output.inventory).all.children.head.hosts["train-a-head"]),
      ) : can(regex("^(ansible|ray|nvidia_driver|nccl|prometheus|mlflow|node_exporter|dcgm_exporter|grafana|common|log_shipping|spot_agent)_", k))
    ])
    error_message = "every inventory variable must start with ansible_ or a role prefix (ray_, nvidia_driver_, nccl_, prometheus_, mlflow_, node_exporter_, dcgm_exporter_, grafana_, common_, log_shipping_, spot_agent_)"
  }
}

run "rendered_inventory_matches_the_committed_example" {
  command = apply

  assert {
    condition     = output.inventory == file("../../examples/aws_cluster/inventory.example.yml")
    error_message = "terraform/examples/aws_cluster/inventory.example.yml is stale: re-render it with `make generate`"
  }
}

run "spec_without_addresses_plans_and_renders_no_inventory" {
  command = plan

  variables {
    node_addresses      = {}
    head_public_address = null
  }

  assert {
    condition     = output.inventory == null && length(output.node_names) == 4
    error_message = "before the nodes exist the spec must still derive node names and leave the inventory null"
  }
}

run "workers_without_public_head_get_no_proxy_jump" {
  command = apply

  variables {
    head_public_address = null
    checkpoint_bucket   = null
    shared_filesystem   = null
  }

  assert {
    condition     = !strcontains(output.inventory, "ProxyJump") && !strcontains(output.inventory, "s3://") && yamldecode(output.inventory).all.children.head.hosts["train-a-head"].ansible_host == "10.42.0.10"
    error_message = "with no public head address and no bucket the inventory must use private addresses and render no storage variables"
  }
}

################################################################################
# Validation: each block rejects bad input
################################################################################

run "rejects_cluster_name_that_is_not_dns_safe" {
  command = plan
  variables {
    cluster_name = "Train_A"
  }
  expect_failures = [var.cluster_name]
}

run "rejects_invalid_vpc_cidr" {
  command = plan
  variables {
    vpc_cidr = "10.42.0.0/8"
  }
  expect_failures = [var.vpc_cidr]
}

run "rejects_malformed_admin_cidr" {
  command = plan
  variables {
    admin_cidrs = ["203.0.113.300/24"]
  }
  expect_failures = [var.admin_cidrs]
}

run "rejects_admin_cidr_open_to_the_internet" {
  command = plan
  variables {
    admin_cidrs = ["203.0.113.0/24", "0.0.0.0/0"]
  }
  expect_failures = [var.admin_cidrs]
}

run "rejects_admin_cidrs_that_cover_the_internet_in_halves" {
  command = plan
  variables {
    admin_cidrs = ["0.0.0.0/1", "128.0.0.0/1"]
  }
  expect_failures = [var.admin_cidrs]
}

run "rejects_admin_cidr_broader_than_the_minimum_prefix" {
  command = plan
  variables {
    admin_cidrs = ["10.0.0.0/7"]
  }
  expect_failures = [var.admin_cidrs]
}

run "rejects_admin_cidr_broader_than_a_raised_minimum" {
  command = plan
  variables {
    admin_cidrs                  = ["198.51.100.0/20"]
    admin_cidr_min_prefix_length = 24
  }
  expect_failures = [var.admin_cidrs]
}

run "accepts_an_admin_cidr_at_the_minimum_prefix" {
  command = plan
  variables {
    admin_cidrs = ["10.0.0.0/8"]
  }
  assert {
    condition     = output.admin_cidrs == tolist(["10.0.0.0/8"])
    error_message = "a /8 is at the default minimum prefix length and must be accepted"
  }
}

run "rejects_bad_head_instance_type" {
  command = plan
  variables {
    head_instance_type = "big-machine"
  }
  expect_failures = [var.head_instance_type]
}

run "rejects_empty_pools" {
  command = plan
  variables {
    pools          = {}
    node_addresses = {}
  }
  expect_failures = [var.pools]
}

run "rejects_pool_name_that_is_not_dns_safe" {
  command = plan
  variables {
    pools = { "A100_pool" = { instance_type = "p4d.24xlarge", count = 1, gpus_per_node = 8 } }
  }
  expect_failures = [var.pools]
}

run "rejects_pool_count_above_32" {
  command = plan
  variables {
    pools = { a100 = { instance_type = "p4d.24xlarge", count = 33, gpus_per_node = 8 } }
  }
  expect_failures = [var.pools]
}

run "rejects_pool_count_of_zero" {
  command = plan
  variables {
    pools = { a100 = { instance_type = "p4d.24xlarge", count = 0, gpus_per_node = 8 } }
  }
  expect_failures = [var.pools]
}

run "rejects_more_than_8_gpus_per_node" {
  command = plan
  variables {
    pools = { a100 = { instance_type = "p4d.24xlarge", count = 1, gpus_per_node = 16 } }
  }
  expect_failures = [var.pools]
}

run "rejects_unknown_capacity_type" {
  command = plan
  variables {
    pools = { a100 = { instance_type = "p4d.24xlarge", count = 1, gpus_per_node = 8, capacity_type = "reserved" } }
  }
  expect_failures = [var.pools]
}

run "rejects_non_gpu_instance_type" {
  command = plan
  variables {
    pools = { cpu = { instance_type = "m6i.2xlarge", count = 1, gpus_per_node = 1 } }
  }
  expect_failures = [var.pools]
}

run "rejects_gpus_per_node_that_disagree_with_instance_type" {
  command = plan
  variables {
    pools          = { a100 = { instance_type = "p4d.24xlarge", count = 1, gpus_per_node = 4 } }
    node_addresses = {}
  }
  expect_failures = [output.pools]
}

run "rejects_node_addresses_that_are_not_ipv4" {
  command = plan
  variables {
    node_addresses = { "train-a-head" = "head.internal" }
  }
  expect_failures = [var.node_addresses]
}

run "rejects_inventory_with_a_node_missing_its_address" {
  command = plan
  variables {
    node_addresses = {
      "train-a-head"    = "10.42.0.10"
      "train-a-a100-00" = "10.42.1.11"
    }
  }
  expect_failures = [output.inventory]
}

run "rejects_unknown_shared_filesystem_type" {
  command = plan
  variables {
    shared_filesystem = { type = "nfs", source = "10.0.0.5:/export" }
  }
  expect_failures = [var.shared_filesystem]
}

run "security_group_ports_cover_every_port_in_the_inventory" {
  command = plan

  assert {
    condition = alltrue([
      for port in [6379, 8265, 10001, 8076, 8077, 8080, 52365, 52366, 52367, 10002, 19999, 9090, 9100, 9400, 5000, 3000, 8000, 8100] :
      anytrue([for r in values(output.security_group_ports) : port >= r.from && port <= r.to])
    ])
    error_message = "every Ray, metrics and MLflow port the inventory pins must be open inside the cluster security group: ${jsonencode(output.security_group_ports)}"
  }
}
