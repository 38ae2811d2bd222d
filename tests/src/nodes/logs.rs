//! The kubelet's log endpoint, `GET /containerLogs/{namespace}/{pod}/{container}`, over HTTPS,
//! which the API server calls for `pods/log`. `timestamps=true` keeps each line's stamp,
//! `tailLines=N` keeps the last N lines; `follow` is answered with what there is so far.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;

use super::containers::Log;

/// The kubelet's serving certificate and key, PEM.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {message}")]
    Pem { path: PathBuf, message: String },
    #[error("the serving certificate: {0}")]
    Tls(#[from] tokio_rustls::rustls::Error),
    #[error("binding 127.0.0.1: {0}")]
    Bind(std::io::Error),
}

/// A container's place: namespace, pod, container.
type ContainerKey = (String, String, String);

/// Every container's log, by namespace, pod and container.
#[derive(Debug, Clone, Default)]
pub struct Store {
    logs: Arc<Mutex<HashMap<ContainerKey, Arc<Log>>>>,
}

impl Store {
    pub fn insert(&self, namespace: &str, pod: &str, container: &str, log: Arc<Log>) {
        let key = (namespace.to_owned(), pod.to_owned(), container.to_owned());
        self.logs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, log);
    }

    pub fn remove_pod(&self, namespace: &str, pod: &str) {
        self.logs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(ns, p, _), _| !(ns == namespace && p == pod));
    }

    fn get(&self, namespace: &str, pod: &str, container: &str) -> Option<Arc<Log>> {
        let key = (namespace.to_owned(), pod.to_owned(), container.to_owned());
        self.logs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .cloned()
    }
}

fn tls_config(files: &TlsFiles) -> Result<ServerConfig, Error> {
    let pem_error = |path: &PathBuf| {
        let path = path.clone();
        move |e: rustls_pki_types::pem::Error| Error::Pem {
            path,
            message: e.to_string(),
        }
    };
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .map_err(pem_error(&files.cert))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error(&files.cert))?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(pem_error(&files.key))?;
    Ok(
        ServerConfig::builder_with_provider(Arc::new(tokio_rustls::rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(certs, key)?,
    )
}

/// What `GET path?query` answers.
fn answer(store: &Store, path: &str, query: Option<&str>) -> (StatusCode, String) {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let ["containerLogs", namespace, pod, container] = parts[..] else {
        return (
            StatusCode::NOT_FOUND,
            format!("{path}: not served by an emulated kubelet\n"),
        );
    };
    let Some(log) = store.get(namespace, pod, container) else {
        return (
            StatusCode::NOT_FOUND,
            format!("container {container:?} in pod {namespace}/{pod} is not here\n"),
        );
    };
    let text = std::fs::read_to_string(&log.path).unwrap_or_default();
    let params: HashMap<&str, &str> = query
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .collect();
    let timestamps = params.get("timestamps") == Some(&"true");
    let mut lines: Vec<&str> = text
        .lines()
        .map(|line| {
            if timestamps {
                line
            } else {
                line.split_once(' ').map_or(line, |(_, rest)| rest)
            }
        })
        .collect();
    if let Some(tail) = params.get("tailLines").and_then(|n| n.parse::<usize>().ok()) {
        lines.drain(..lines.len().saturating_sub(tail));
    }
    let mut body = lines.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    (StatusCode::OK, body)
}

/// Serves `store` on a port of 127.0.0.1 the OS picks; returns the port and the serving task.
pub async fn serve(files: &TlsFiles, store: Store) -> Result<(u16, JoinHandle<()>), Error> {
    let acceptor = TlsAcceptor::from(Arc::new(tls_config(files)?));
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(Error::Bind)?;
    let port = listener.local_addr().map_err(Error::Bind)?.port();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let store = store.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    let (status, body) = answer(&store, request.uri().path(), request.uri().query());
                    let mut response = Response::new(Full::new(Bytes::from(body)));
                    *response.status_mut() = status;
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((port, task))
}
