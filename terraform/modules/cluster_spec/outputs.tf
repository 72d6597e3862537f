output "cluster_name" {
  description = "The validated cluster name."
  value       = var.cluster_name
}

output "vpc_cidr" {
  description = "The validated VPC CIDR."
  value       = var.vpc_cidr
}

output "admin_cidrs" {
  description = "The validated admin CIDRs (never 0.0.0.0/0)."
  value       = var.admin_cidrs
}

output "head_node_name" {
  description = "Name of the Ray head node (also the monitoring host)."
  value       = local.head_node_name
}

output "head_instance_type" {
  description = "EC2 instance type of the head node."
  value       = var.head_instance_type
}

output "pools" {
  description = "Derived pool settings keyed by pool name: instance_type, count, gpus_per_node, capacity_type, spot, vcpus, efa_count, efa_supported, node_names, ray_resources."
  value       = local.pools

  precondition {
    condition     = length(local.gpu_count_mismatches) == 0
    error_message = "gpus_per_node must equal the GPU count of the instance type: ${join("; ", local.gpu_count_mismatches)}."
  }
}

output "efa_supported" {
  description = "True when at least one pool's instance type supports EFA."
  value       = anytrue([for p in values(local.pools) : p.efa_supported])
}

output "node_names" {
  description = "Every node name: the head first, then the workers of each pool in pool-name order."
  value       = local.node_names
}

output "ray_resources" {
  description = "Ray custom resources advertised by each node, keyed by node name."
  value       = local.ray_resources
}

output "total_gpus" {
  description = "Total GPUs across all pools."
  value       = local.total_gpus
}

output "ports" {
  description = "Ports the platform's services listen on (Ray, Prometheus, exporters, MLflow, Grafana)."
  value       = local.ports
}

output "security_group_ports" {
  description = "Port ranges ({ from, to }) the cluster's nodes use among themselves, keyed by purpose; the network module opens exactly these inside the cluster security group."
  value       = local.security_group_ports
}

output "inventory" {
  description = "Ansible inventory YAML (groups head, gpu_workers, monitoring); null while node_addresses is empty."
  value       = local.inventory

  precondition {
    condition     = !local.has_addresses || (length(local.missing_addresses) == 0 && length(local.unknown_addresses) == 0)
    error_message = "node_addresses must hold exactly one address per node. Missing: [${join(", ", local.missing_addresses)}]; not a node of this cluster: [${join(", ", local.unknown_addresses)}]."
  }
}
