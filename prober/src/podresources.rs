//! Which pod holds which GPU, from the kubelet's pod-resources API: `v1.PodResourcesLister/List`,
//! gRPC over the unix socket the kubelet serves (`/var/lib/kubelet/pod-resources/kubelet.sock`).
//!
//! One unary call over HTTP/2, and the few protobuf fields it needs decoded by hand (pod name and
//! namespace, container name, each device's resource name and ids), so that no gRPC stack is
//! linked for one call. The NVIDIA device plugin names a GPU by its UUID (`GPU-…`), a MIG device
//! by its own (`MIG-…`), and a time-sliced share as `UUID::N`; the share suffix is dropped, so a
//! device id is a UUID NVML knows. This module reads; it must never allocate or free a device.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// Where the kubelet serves the API.
pub const KUBELET_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// The GPU resource the NVIDIA device plugin advertises.
pub const NVIDIA_GPU: &str = "nvidia.com/gpu";
const LIST: &str = "/v1.PodResourcesLister/List";
/// The most of an answer that is read: a node's pods and their devices fit in far less.
const MAX_ANSWER: usize = 16 << 20;

/// One container's devices of one resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodDevices {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub resource: String,
    /// The device ids, a time-sliced share's suffix dropped.
    pub devices: Vec<String>,
}

/// Why the pods' devices could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connecting to {socket}: {reason}")]
    Connect { socket: String, reason: String },
    #[error("the List call failed: {0}")]
    Call(String),
    #[error("the kubelet answered grpc-status {status}: {message}")]
    Status { status: String, message: String },
    #[error("the answer is not a ListPodResourcesResponse: {0}")]
    Decode(&'static str),
}

/// Lists every container's devices on this node through the kubelet's socket, within `timeout`.
///
/// # Errors
/// When the socket cannot be reached, the call fails or times out, or the answer is malformed.
pub async fn list(socket: &Path, timeout: Duration) -> Result<Vec<PodDevices>, Error> {
    tokio::time::timeout(timeout, list_now(socket))
        .await
        .map_err(|_| Error::Call(format!("no answer within {timeout:?}")))?
}

async fn list_now(socket: &Path) -> Result<Vec<PodDevices>, Error> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|error| Error::Connect {
            socket: socket.display().to_string(),
            reason: error.to_string(),
        })?;
    let (mut sender, connection) = hyper::client::conn::http2::handshake::<_, _, Full<Bytes>>(
        TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .map_err(|error| Error::Call(format!("HTTP/2 handshake: {error}")))?;
    let connection = tokio::spawn(connection);
    // An empty ListPodResourcesRequest: no compression, length 0.
    let request = http::Request::post(format!("http://localhost{LIST}"))
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(Full::new(Bytes::from_static(&[0, 0, 0, 0, 0])))
        .map_err(|error| Error::Call(error.to_string()))?;
    let answer = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|error| Error::Call(error.to_string()))?;
        let (parts, body) = response.into_parts();
        if parts.status != http::StatusCode::OK {
            return Err(Error::Call(format!("HTTP {}", parts.status)));
        }
        let collected = Limited::new(body, MAX_ANSWER)
            .collect()
            .await
            .map_err(|error| Error::Call(error.to_string()))?;
        let trailers = collected.trailers().cloned().unwrap_or_default();
        let grpc = |name: &str| {
            trailers
                .get(name)
                .or_else(|| parts.headers.get(name))
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        match grpc("grpc-status").as_deref() {
            Some("0") => {}
            status => {
                return Err(Error::Status {
                    status: status.unwrap_or("absent").to_owned(),
                    message: grpc("grpc-message").unwrap_or_default(),
                });
            }
        }
        decode_response(&unframe(&collected.to_bytes())?)
    }
    .await;
    connection.abort();
    answer
}

/// The one message of a unary gRPC answer, its 5-byte prefix checked.
fn unframe(body: &[u8]) -> Result<Vec<u8>, Error> {
    let [compressed, a, b, c, d, rest @ ..] = body else {
        return Err(Error::Decode("shorter than a gRPC message prefix"));
    };
    if *compressed != 0 {
        return Err(Error::Decode("the message is compressed"));
    }
    let length = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
    rest.get(..length)
        .map(<[u8]>::to_vec)
        .ok_or(Error::Decode("the message is shorter than its prefix says"))
}

/// A protobuf field: its number, and its varint or its bytes (fixed-width ones are skipped).
enum Field<'a> {
    Varint,
    Bytes(&'a [u8]),
}

fn varint(buf: &mut &[u8]) -> Result<u64, Error> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = buf
            .split_first()
            .ok_or(Error::Decode("a varint runs past the end"))?;
        *buf = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(Error::Decode("a varint is longer than ten bytes"))
}

/// Every field of one message, in order.
fn fields(mut buf: &[u8]) -> Result<Vec<(u64, Field<'_>)>, Error> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        let (number, wire) = (key >> 3, key & 7);
        let field = match wire {
            0 => {
                varint(&mut buf)?;
                Field::Varint
            }
            1 | 5 => {
                let width = if wire == 1 { 8 } else { 4 };
                buf = buf
                    .get(width..)
                    .ok_or(Error::Decode("a fixed field runs past the end"))?;
                Field::Varint
            }
            2 => {
                let length =
                    usize::try_from(varint(&mut buf)?).map_err(|_| Error::Decode("a length overflows"))?;
                let (bytes, rest) = (
                    buf.get(..length)
                        .ok_or(Error::Decode("a field runs past the end"))?,
                    &buf[length..],
                );
                buf = rest;
                Field::Bytes(bytes)
            }
            _ => return Err(Error::Decode("an unknown wire type")),
        };
        out.push((number, field));
    }
    Ok(out)
}

fn text(bytes: &[u8]) -> Result<String, Error> {
    String::from_utf8(bytes.to_vec()).map_err(|_| Error::Decode("a string is not UTF-8"))
}

/// `ListPodResourcesResponse { repeated PodResources pod_resources = 1; }`, each
/// `PodResources { name = 1; namespace = 2; repeated ContainerResources containers = 3; }`, each
/// `ContainerResources { name = 1; repeated ContainerDevices devices = 2; … }`, each
/// `ContainerDevices { resource_name = 1; repeated string device_ids = 2; … }`.
fn decode_response(message: &[u8]) -> Result<Vec<PodDevices>, Error> {
    let mut out = Vec::new();
    for (number, field) in fields(message)? {
        let (1, Field::Bytes(pod)) = (number, field) else {
            continue;
        };
        let (mut name, mut namespace, mut containers) = (String::new(), String::new(), Vec::new());
        for (number, field) in fields(pod)? {
            match (number, field) {
                (1, Field::Bytes(b)) => name = text(b)?,
                (2, Field::Bytes(b)) => namespace = text(b)?,
                (3, Field::Bytes(b)) => containers.push(b),
                _ => {}
            }
        }
        for container in containers {
            let (mut container_name, mut devices) = (String::new(), Vec::new());
            for (number, field) in fields(container)? {
                match (number, field) {
                    (1, Field::Bytes(b)) => container_name = text(b)?,
                    (2, Field::Bytes(b)) => devices.push(b),
                    _ => {}
                }
            }
            for device in devices {
                let (mut resource, mut ids) = (String::new(), Vec::new());
                for (number, field) in fields(device)? {
                    match (number, field) {
                        (1, Field::Bytes(b)) => resource = text(b)?,
                        (2, Field::Bytes(b)) => {
                            let id = text(b)?;
                            let uuid = id.split_once("::").map_or(id.as_str(), |(uuid, _share)| uuid);
                            ids.push(uuid.to_owned());
                        }
                        _ => {}
                    }
                }
                out.push(PodDevices {
                    namespace: namespace.clone(),
                    pod: name.clone(),
                    container: container_name.clone(),
                    resource,
                    devices: ids,
                });
            }
        }
    }
    Ok(out)
}

/// Serves `v1.PodResourcesLister/List` on `listener` as the kubelet does, answering what
/// `pods` gives at each call, until dropped: for the emulated GPU nodes and tests, where no
/// kubelet runs.
pub async fn serve(
    listener: tokio::net::UnixListener,
    pods: std::sync::Arc<dyn Fn() -> Vec<PodDevices> + Send + Sync>,
) {
    use std::convert::Infallible;

    use http_body_util::StreamBody;
    use hyper::body::Frame;

    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let pods = pods.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    let message = encode_response(&pods());
                    async move {
                        let (status, body) = if request.uri().path() == LIST {
                            let mut framed = vec![0];
                            framed.extend_from_slice(
                                &u32::try_from(message.len()).unwrap_or(u32::MAX).to_be_bytes(),
                            );
                            framed.extend_from_slice(&message);
                            ("0", framed)
                        } else {
                            ("12", Vec::new())
                        };
                        let mut trailers = http::HeaderMap::new();
                        trailers.insert("grpc-status", http::HeaderValue::from_static(status));
                        let frames = futures::stream::iter([
                            Ok::<_, Infallible>(Frame::data(Bytes::from(body))),
                            Ok(Frame::trailers(trailers)),
                        ]);
                        hyper::Response::builder()
                            .header(http::header::CONTENT_TYPE, "application/grpc")
                            .body(StreamBody::new(frames))
                    }
                });
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Encodes `pods` as the kubelet would answer them, for tests and fakes.
#[must_use]
pub fn encode_response(pods: &[PodDevices]) -> Vec<u8> {
    fn field(out: &mut Vec<u8>, number: u64, bytes: &[u8]) {
        put_varint(out, (number << 3) | 2);
        put_varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }
    fn put_varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }
    let mut message = Vec::new();
    for pod in pods {
        let mut device = Vec::new();
        field(&mut device, 1, pod.resource.as_bytes());
        for id in &pod.devices {
            field(&mut device, 2, id.as_bytes());
        }
        let mut container = Vec::new();
        field(&mut container, 1, pod.container.as_bytes());
        field(&mut container, 2, &device);
        let mut resources = Vec::new();
        field(&mut resources, 1, pod.pod.as_bytes());
        field(&mut resources, 2, pod.namespace.as_bytes());
        field(&mut resources, 3, &container);
        field(&mut message, 1, &resources);
    }
    message
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn devices(pod: &str, ids: &[&str]) -> PodDevices {
        PodDevices {
            namespace: "serving".to_owned(),
            pod: pod.to_owned(),
            container: "vllm".to_owned(),
            resource: NVIDIA_GPU.to_owned(),
            devices: ids.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn what_the_kubelet_encodes_decodes_back_and_a_shares_suffix_is_dropped() {
        let pods = [
            devices("vllm-0", &["GPU-aa", "GPU-bb"]),
            devices("vllm-1", &["GPU-cc::3"]),
        ];
        let decoded = decode_response(&encode_response(&pods)).unwrap();
        assert_eq!(decoded[0], pods[0]);
        assert_eq!(decoded[1].devices, ["GPU-cc"]);
    }

    #[test]
    fn garbled_answers_are_errors_not_panics() {
        let good = encode_response(&[devices("vllm-0", &["GPU-aa"])]);
        for cut in 1..good.len() {
            let _ = decode_response(&good[..cut]);
        }
        assert!(matches!(unframe(&[0, 0, 0, 0, 9, 1]), Err(Error::Decode(_))));
        assert!(matches!(unframe(&[1, 0, 0, 0, 0]), Err(Error::Decode(_))));
        assert!(matches!(decode_response(&[0x0b]), Err(Error::Decode(_))));
        assert!(matches!(decode_response(&[0x0a, 0xff]), Err(Error::Decode(_))));
    }
}
