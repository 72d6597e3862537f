################################################################################
# Cluster
################################################################################

variable "region" {
  description = "AWS region of the cluster."
  type        = string
  default     = "us-east-1"
  nullable    = false
}

variable "azs" {
  description = "Availability zones (the first one hosts the GPU pools, which share a cluster placement group); null uses the region's first two."
  type        = list(string)
  default     = null
}

variable "cluster_name" {
  description = "Name of the cluster (DNS-safe; validated by cluster_spec)."
  type        = string
  default     = "train-a"
  nullable    = false
}

variable "vpc_cidr" {
  description = "IPv4 CIDR of the cluster VPC (/16 to /24)."
  type        = string
  default     = "10.42.0.0/16"
  nullable    = false
}

variable "admin_cidrs" {
  description = "CIDRs allowed to SSH to the head node, e.g. [\"203.0.113.7/32\"] (your address); dashboards are reached through that SSH connection. Never broader than admin_cidr_min_prefix_length."
  type        = list(string)
  nullable    = false
}

variable "admin_cidr_min_prefix_length" {
  description = "Shortest prefix length admin_cidrs may have (8: nothing broader than a /8)."
  type        = number
  default     = 8
  nullable    = false
}

variable "ssh_key_name" {
  description = "Existing EC2 key pair that Ansible logs in with (its private key must be in your ssh-agent)."
  type        = string
  nullable    = false
}

variable "ssh_user" {
  description = "The AMI's login user, whom Ansible logs in as and jumps through the head with: admin on Debian's images (the default); set it when your own Debian 12 AMI (ami_id) logs in as another user."
  type        = string
  default     = "admin"
  nullable    = false
}

################################################################################
# Nodes
################################################################################

variable "head_instance_type" {
  description = "CPU instance type of the Ray head node (also runs Prometheus, Grafana and MLflow)."
  type        = string
  default     = "m6i.2xlarge"
  nullable    = false
}

variable "pools" {
  description = "GPU worker pools keyed by name; see terraform/modules/cluster_spec (instance_type, count 1-32, gpus_per_node 1-8, capacity_type on_demand|spot, ray_resources)."
  type = map(object({
    instance_type = string
    count         = number
    gpus_per_node = number
    capacity_type = optional(string, "on_demand")
    ray_resources = optional(map(number), {})
  }))
  default = {
    a10g = { instance_type = "g5.12xlarge", count = 2, gpus_per_node = 4 }
  }
  nullable = false
}

variable "ami_id" {
  description = "AMI ID of every node (a Debian 12 image); null looks up ami_name from Debian's account in the region."
  type        = string
  default     = null
}

variable "ami_name" {
  description = "Exact name of the Debian 12 build every node boots (the OS the Ansible roles are tested on); see modules/gpu_node_pool."
  type        = string
  default     = "debian-12-amd64-20240717-1811"
  nullable    = false
}

################################################################################
# Storage
################################################################################

variable "checkpoint_bucket_name" {
  description = "Name of the checkpoint bucket; null derives <cluster_name>-checkpoints-<account id>."
  type        = string
  default     = null
}

variable "create_fsx_lustre" {
  description = "Also create an FSx for Lustre file system (mounted instead of EFS)."
  type        = bool
  default     = false
  nullable    = false
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
  nullable    = false
}
