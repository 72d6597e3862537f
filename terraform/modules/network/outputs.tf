output "vpc_id" {
  description = "ID of the VPC."
  value       = aws_vpc.this.id
}

output "public_subnet_ids" {
  description = "Public subnet IDs in azs order (the head node and the NAT gateway)."
  value       = [for az in var.azs : aws_subnet.public[az].id]
}

output "private_subnet_ids" {
  description = "Private subnet IDs in azs order (GPU workers, EFS/FSx mount targets)."
  value       = [for az in var.azs : aws_subnet.private[az].id]
}

output "security_group_id" {
  description = "ID of the cluster security group every node joins."
  value       = aws_security_group.this.id
}

output "admin_security_group_id" {
  description = "ID of the admin security group (SSH and dashboards from admin_cidrs), for the head node."
  value       = aws_security_group.admin.id
}

output "placement_group_name" {
  description = "Name of the cluster placement group, or null when create_placement_group is false."
  value       = try(aws_placement_group.this[0].name, null)
}

output "nat_gateway_public_ip" {
  description = "Public IP of the NAT gateway (what outside services see for private nodes), or null."
  value       = try(aws_eip.nat[0].public_ip, null)
}
