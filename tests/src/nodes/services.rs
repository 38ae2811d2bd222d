//! kube-proxy's part on the emulated nodes: a Service's cluster IP forwards to its ready pods.
//!
//! The cluster tier gives Services cluster IPs on loopback (`UNDERSTUDY_SERVICE_RANGE`, up.sh), so
//! a cluster IP can be bound here where a node's kube-proxy rules would catch it. For every TCP
//! port of every Service with a selector and a loopback cluster IP, this listens on
//! `CLUSTER_IP:PORT` and forwards each connection, whole, to one of the Service's endpoints as
//! they are when the connection is accepted: a pod in the Service's namespace whose labels match
//! the selector, Ready, not being deleted, with an address, at the port's `targetPort` (a number,
//! or a container port's name). Endpoints are taken in turn, as IPVS's round robin does. A
//! connection already forwarded stays with its pod, as conntrack keeps it, so a moved selector
//! moves new connections only. A Service with no endpoint closes what it accepted, where
//! kube-proxy would reject it.
//!
//! It is here because the pods' loopback addresses cannot be in EndpointSlices (the API server
//! refuses them), so a gateway that reads EndpointSlices finds no backend; one that sends to the
//! cluster IP (Traefik's `nativeLB`) reaches the pods through this.
//!
//! It must never bind an address outside loopback, nor forward to a pod of another namespace.
//!
//! Not emulated: UDP and SCTP, session affinity, topology, terminating endpoints, NodePorts and
//! external traffic; and kube-proxy's lag: a moved selector moves the next connection here, where
//! a real cluster first updates the EndpointSlices and then each node's rules.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Service, ServicePort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::net::{TcpListener, TcpStream};

use crate::cluster::is_ready;

/// One listener: a Service's port on its cluster IP.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Listening {
    at: SocketAddr,
    service: ObjectRef<Service>,
}

/// Forwards Services' cluster IPs until the Service watch ends.
pub(super) async fn serve(client: Client) {
    let (pods, pod_writer) = reflector::store::<Pod>();
    let pod_watch = watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .reflect(pod_writer)
        .for_each(|_| futures::future::ready(()));
    let pod_watch = AbortOnDrop(tokio::spawn(pod_watch));
    // Connections accepted before the pods are known would find no endpoint.
    let _ = pods.wait_until_ready().await;
    let (services, service_writer) = reflector::store::<Service>();
    let mut service_events = watcher(Api::<Service>::all(client), watcher::Config::default())
        .default_backoff()
        .reflect(service_writer)
        .boxed();
    let mut listeners: HashMap<Listening, AbortOnDrop> = HashMap::new();
    while let Some(event) = service_events.next().await {
        match event {
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => continue,
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%error, "the Service watch failed; it resumes");
                continue;
            }
        }
        let wanted: Vec<Listening> = services.state().iter().flat_map(|s| listening(s)).collect();
        // One that could not bind is tried again.
        listeners.retain(|at, task| wanted.contains(at) && !task.0.is_finished());
        for at in wanted {
            listeners
                .entry(at.clone())
                .or_insert_with(|| AbortOnDrop(tokio::spawn(forward(at, services.clone(), pods.clone()))));
        }
    }
    drop(pod_watch);
}

/// The addresses a Service is reached at here: each TCP port on its loopback cluster IP, when
/// it has a selector (one without is someone else's to fill).
fn listening(service: &Service) -> Vec<Listening> {
    let Some(spec) = &service.spec else {
        return Vec::new();
    };
    let ip = spec
        .cluster_ip
        .as_deref()
        .and_then(|ip| ip.parse::<IpAddr>().ok());
    let (Some(ip), Some(_)) = (
        ip.filter(IpAddr::is_loopback),
        spec.selector.as_ref().filter(|s| !s.is_empty()),
    ) else {
        return Vec::new();
    };
    spec.ports
        .iter()
        .flatten()
        .filter(|p| tcp(p))
        .filter_map(|p| u16::try_from(p.port).ok())
        .map(|port| Listening {
            at: SocketAddr::new(ip, port),
            service: ObjectRef::from_obj(service),
        })
        .collect()
}

/// Accepts on a Service's port and hands each connection to an endpoint in turn.
async fn forward(at: Listening, services: Store<Service>, pods: Store<Pod>) {
    // A listener just let go (its Service deleted, the address given to another) may hold the
    // address a moment longer.
    let mut tries = 0;
    let listener = loop {
        match TcpListener::bind(at.at).await {
            Ok(listener) => break listener,
            Err(error) if tries < 50 => {
                tries += 1;
                tracing::debug!(address = %at.at, %error, "binding a cluster IP; trying again");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(error) => {
                tracing::warn!(address = %at.at, %error, "cannot bind a cluster IP");
                return;
            }
        }
    };
    tracing::info!(address = %at.at, service = %at.service, "forwarding a cluster IP");
    let mut turn = 0usize;
    loop {
        let inbound = match listener.accept().await {
            Ok((inbound, _)) => inbound,
            Err(error) => {
                tracing::warn!(address = %at.at, %error, "accepting on a cluster IP");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(service) = services.get(&at.service) else {
            continue;
        };
        let endpoints = endpoints(&service, at.at.port(), &pods.state());
        turn = turn.wrapping_add(1);
        let Some(&to) = endpoints.get(turn % endpoints.len().max(1)) else {
            tracing::debug!(address = %at.at, "no endpoint; the connection is closed");
            continue;
        };
        tokio::spawn(async move {
            let mut inbound = inbound;
            match TcpStream::connect(to).await {
                Ok(mut outbound) => {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
                Err(error) => tracing::debug!(%to, %error, "an endpoint refused a forwarded connection"),
            }
        });
    }
}

/// Where a Service's `port` goes: the ready pods its selector matches, at the port's
/// `targetPort`, in address order.
fn endpoints(service: &Service, port: u16, pods: &[Arc<Pod>]) -> Vec<SocketAddr> {
    let Some(spec) = &service.spec else {
        return Vec::new();
    };
    let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) else {
        return Vec::new();
    };
    let Some(service_port) = spec
        .ports
        .iter()
        .flatten()
        .find(|p| tcp(p) && p.port == i32::from(port))
    else {
        return Vec::new();
    };
    let mut endpoints: Vec<SocketAddr> = pods
        .iter()
        .filter(|pod| pod.namespace() == service.namespace() && pod.metadata.deletion_timestamp.is_none())
        .filter(|pod| selector.iter().all(|(k, v)| pod.labels().get(k) == Some(v)))
        .filter(|pod| is_ready(pod))
        .filter_map(|pod| {
            let ip = pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok()?;
            Some(SocketAddr::new(ip, target_port(service_port, pod)?))
        })
        .collect();
    endpoints.sort();
    endpoints
}

/// A TCP port: the protocol a port without one has.
fn tcp(port: &ServicePort) -> bool {
    port.protocol.as_deref().unwrap_or("TCP") == "TCP"
}

/// A Service port's `targetPort` on `pod`: a number, a container port's name, or the port itself.
fn target_port(port: &ServicePort, pod: &Pod) -> Option<u16> {
    match &port.target_port {
        None => u16::try_from(port.port).ok(),
        Some(IntOrString::Int(n)) => u16::try_from(*n).ok(),
        Some(IntOrString::String(name)) => pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| u16::try_from(p.container_port).ok()),
    }
}

/// A task stopped when its handle goes.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(cluster_ip: &str, target_port: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": "chat-east", "namespace": "serving"},
            "spec": {"clusterIP": cluster_ip, "selector": {"app": "chat-east"},
                     "ports": [{"port": 9000, "targetPort": target_port}, {"port": 53, "protocol": "UDP"}]},
        }))
        .unwrap()
    }

    fn pod(ns: &str, app: &str, ip: &str, ready: bool, deleted: bool) -> Arc<Pod> {
        let mut value = json!({
            "metadata": {"name": format!("{app}-{ip}"), "namespace": ns, "labels": {"app": app, "pod-template-hash": "abc"}},
            "spec": {"containers": [{"name": "fence", "ports": [{"name": "fence", "containerPort": 9100}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
        });
        if deleted {
            value["metadata"]["deletionTimestamp"] = json!("2026-12-06T08:00:00Z");
        }
        Arc::new(serde_json::from_value(value).unwrap())
    }

    #[test]
    fn a_services_endpoints_are_its_namespaces_ready_matching_pods_at_the_target_port() {
        let pods = [
            pod("serving", "chat-east", "127.0.0.12", true, false),
            pod("serving", "chat-east", "127.0.0.11", true, false),
            pod("serving", "chat-east", "127.0.0.13", false, false),
            pod("serving", "chat-east", "127.0.0.14", true, true),
            pod("serving", "chat-west", "127.0.0.15", true, false),
            pod("other", "chat-east", "127.0.0.16", true, false),
        ];
        let by_number = service("127.0.200.7", json!(9100));
        let want: Vec<SocketAddr> = vec![
            "127.0.0.11:9100".parse().unwrap(),
            "127.0.0.12:9100".parse().unwrap(),
        ];
        assert_eq!(endpoints(&by_number, 9000, &pods), want);
        assert_eq!(
            endpoints(&service("127.0.200.7", json!("fence")), 9000, &pods),
            want
        );
        assert_eq!(
            endpoints(&service("127.0.200.7", json!("metrics")), 9000, &pods),
            []
        );
        assert_eq!(endpoints(&by_number, 9001, &pods), []);
    }

    #[test]
    fn only_tcp_ports_on_a_loopback_cluster_ip_with_a_selector_are_listened_on() {
        let listened = listening(&service("127.0.200.7", json!(9100)));
        assert_eq!(
            listened.iter().map(|l| l.at).collect::<Vec<_>>(),
            ["127.0.200.7:9000".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(listening(&service("10.0.0.7", json!(9100))), []);
        assert_eq!(listening(&service("None", json!(9100))), []);
        let mut no_selector = service("127.0.200.7", json!(9100));
        no_selector.spec.as_mut().unwrap().selector = None;
        assert_eq!(listening(&no_selector), []);
    }
}
