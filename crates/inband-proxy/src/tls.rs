//! TLS termination: certificates from PEM files (with their stapled OCSP
//! responses), chosen by SNI, swapped on reload while the server
//! configuration (and with it the session cache and ticket keys) stays, so
//! connections and resumption survive. And TLS to backends: the verifying
//! client configuration of a pool.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use anyhow::{anyhow, bail, Context, Result};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::client::ResolvesClientCert;
use rustls::server::{ClientHello, ResolvesServerCert, ServerSessionMemoryCache};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

use crate::config::{BackendProtocol, BackendTlsConfig, CertificateConfig, TlsConfig};

/// Sessions kept for TLS 1.2 clients that resume by session ID rather
/// than by ticket; the oldest go first.
const SESSION_CACHE_ENTRIES: usize = 10_240;

/// The certificates of one load: every name of every certificate, and the
/// first configured for clients that send no SNI or a name none has.
#[derive(Debug)]
struct Certs {
    exact: HashMap<String, Arc<CertifiedKey>>,
    /// `*.example.com` under `example.com`: one label deep, as RFC 6125 §6.4.3.
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Arc<CertifiedKey>,
    /// Each certificate file and its leaf's notAfter (seconds since the
    /// epoch), for the metrics.
    expiries: Vec<(String, u64)>,
}

impl Certs {
    fn pick(&self, sni: Option<&str>) -> Arc<CertifiedKey> {
        // rustls hands the SNI over lower-cased.
        let Some(name) = sni else { return self.default.clone() };
        if let Some(c) = self.exact.get(name) {
            return c.clone();
        }
        let parent = name.split_once('.').map(|(_, p)| p);
        parent.and_then(|p| self.wildcard.get(p)).unwrap_or(&self.default).clone()
    }
}

#[derive(Debug)]
struct Resolver(RwLock<Arc<Certs>>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let certs = self.0.read().unwrap_or_else(|e| e.into_inner()).clone();
        Some(certs.pick(hello.server_name()))
    }
}

/// The TLS listener's acceptor and what reloads its certificates.
pub struct Tls {
    pub acceptor: TlsAcceptor,
    resolver: Arc<Resolver>,
    provider: Arc<CryptoProvider>,
    files: Vec<CertificateConfig>,
}

impl Tls {
    /// Loads every certificate; the first problem refuses the start, named
    /// by its file.
    pub fn new(cfg: &TlsConfig) -> Result<Tls> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = load_all(&cfg.certificate, &provider, SystemTime::now())?;
        let resolver = Arc::new(Resolver(RwLock::new(Arc::new(certs))));
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .context("TLS versions")?
            .with_no_client_auth()
            .with_cert_resolver(resolver.clone());
        // hyper-util's auto builder tells h2 from HTTP/1.1 by the preface
        // the client sends after the handshake, so ALPN only has to agree.
        server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        server.session_storage = ServerSessionMemoryCache::new(SESSION_CACHE_ENTRIES);
        // Stateless tickets (TLS 1.2 and 1.3) under a key rustls rotates
        // every 6 hours, keeping the previous one: resumption that costs
        // no memory per session and survives certificate reloads.
        server.ticketer = rustls::crypto::ring::Ticketer::new().context("TLS session ticket keys")?;
        Ok(Tls { acceptor: TlsAcceptor::from(Arc::new(server)), resolver, provider, files: cfg.certificate.clone() })
    }

    /// Each certificate file in use and when its certificate expires.
    pub fn expiries(&self) -> Vec<(String, u64)> {
        self.resolver.0.read().unwrap_or_else(|e| e.into_inner()).expiries.clone()
    }

    /// Reads the certificate files again and swaps them in whole; on any
    /// problem the ones in use stay. Handshakes already done keep theirs.
    pub fn reload(&self) -> Result<()> {
        let certs = load_all(&self.files, &self.provider, SystemTime::now())?;
        *self.resolver.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(certs);
        Ok(())
    }
}

fn load_all(files: &[CertificateConfig], provider: &CryptoProvider, now: SystemTime) -> Result<Certs> {
    let mut exact = HashMap::new();
    let mut wildcard = HashMap::new();
    let mut default = None;
    let mut expiries = Vec::new();
    for f in files {
        let (key, names, not_after) = load(f, provider, now)?;
        let secs = not_after.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        expiries.push((f.cert.display().to_string(), secs));
        let key = Arc::new(key);
        default.get_or_insert_with(|| key.clone());
        // A name in two certificates goes to the one listed first.
        for n in names {
            match n.strip_prefix("*.") {
                Some(parent) => wildcard.entry(parent.to_string()).or_insert_with(|| key.clone()),
                None => exact.entry(n).or_insert_with(|| key.clone()),
            };
        }
    }
    let default = default.ok_or_else(|| anyhow!("tls: no [[tls.certificate]] configured"))?;
    Ok(Certs { exact, wildcard, default, expiries })
}

/// One certificate chain and its key, with the DNS names the leaf is for
/// and its notAfter.
fn load(f: &CertificateConfig, provider: &CryptoProvider, now: SystemTime) -> Result<(CertifiedKey, Vec<String>, SystemTime)> {
    let (cert_file, key_file) = (f.cert.display(), f.key.display());
    readable(&f.cert)?;
    readable(&f.key)?;
    let chain = CertificateDer::pem_file_iter(&f.cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow!("certificate file {cert_file}: not PEM certificates: {e}"))?;
    if chain.is_empty() {
        bail!("certificate file {cert_file}: no CERTIFICATE block in it");
    }
    let (mut names, mut leaf_not_after) = (Vec::new(), now);
    for (i, der) in chain.iter().enumerate() {
        let which = if i == 0 { "the certificate".to_string() } else { format!("chain certificate {}", i + 1) };
        let cert = read_certificate(der).map_err(|e| anyhow!("certificate file {cert_file}: {which} does not parse as X.509: {e}"))?;
        if cert.not_after <= now {
            let date = httpdate::fmt_http_date(cert.not_after);
            bail!("certificate file {cert_file}: {which} expired on {date}");
        }
        if i == 0 {
            (names, leaf_not_after) = (cert.dns_names, cert.not_after);
        }
    }
    let key = PrivateKeyDer::from_pem_file(&f.key).map_err(|e| anyhow!("key file {key_file}: no PEM private key in it: {e}"))?;
    let mut key = CertifiedKey::from_der(chain, key, provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => anyhow!("key file {key_file} does not match the certificate in {cert_file}"),
        e => anyhow!("key file {key_file}: unusable private key: {e}"),
    })?;
    if let Some(ocsp) = &f.ocsp {
        key.ocsp = Some(read_ocsp(ocsp)?);
    }
    Ok((key, names, leaf_not_after))
}

/// An OCSP response to staple: rustls sends the bytes as they are, so
/// they are checked to be a DER OCSPResponse whose status is
/// `successful` (RFC 6960 §4.2.1); a client would reject anything else,
/// and some fail the handshake. Whether it is the certificate's and still
/// fresh is for whoever renews the file to keep true.
fn read_ocsp(path: &Path) -> Result<Vec<u8>> {
    readable(path)?;
    let der = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let status = yasna::parse_der(&der, |r| {
        r.read_sequence(|seq| {
            let status = seq.next().read_enum()?;
            // responseBytes [0] EXPLICIT, present when successful.
            seq.read_optional(|r| r.read_tagged_der().map(drop))?;
            Ok(status)
        })
    })
    .map_err(|e| anyhow!("OCSP response file {}: not a DER OCSPResponse: {e}", path.display()))?;
    if status != 0 {
        bail!("OCSP response file {}: responseStatus is {status}, not successful (0)", path.display());
    }
    Ok(der)
}

/// The client configuration of a pool with `backend_tls`: the CA file's
/// certificates (or the system's) as roots, webpki verification of the
/// chain and of the name (`server_name`, or the backend's IP address), the
/// one ALPN protocol the pool speaks, and a client certificate if given.
/// A CA or client certificate file that cannot be used refuses the start,
/// named.
pub fn backend_client_config(cfg: &BackendTlsConfig, protocol: BackendProtocol) -> Result<Arc<ClientConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    match &cfg.ca {
        Some(ca) => {
            readable(ca)?;
            let certs = CertificateDer::pem_file_iter(ca)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| anyhow!("backend_tls.ca file {}: not PEM certificates: {e}", ca.display()))?;
            if certs.is_empty() {
                bail!("backend_tls.ca file {}: no CERTIFICATE block in it", ca.display());
            }
            for (i, c) in certs.into_iter().enumerate() {
                roots.add(c).map_err(|e| anyhow!("backend_tls.ca file {}: certificate {} is not a usable CA certificate: {e}", ca.display(), i + 1))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found.errors.first().map(|e| format!(" ({e})")).unwrap_or_default();
                bail!("backend_tls: no CA certificates found in the system's store{why}: give backend_tls.ca a PEM file");
            }
        }
    }
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .context("TLS versions")?
        .with_root_certificates(roots);
    let mut config = match (&cfg.cert, &cfg.key) {
        (Some(cert), Some(key)) => {
            let f = CertificateConfig { cert: cert.clone(), key: key.clone(), ocsp: None };
            let (key, _, _) = load(&f, &provider, SystemTime::now()).context("backend_tls client certificate")?;
            builder.with_client_cert_resolver(Arc::new(ClientCert(Arc::new(key))))
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![match protocol {
        BackendProtocol::Http1 => b"http/1.1".to_vec(),
        BackendProtocol::H2 => b"h2".to_vec(),
    }];
    Ok(Arc::new(config))
}

/// The one client certificate of a pool, whatever the backend asks for
/// (a backend that cannot use it fails the handshake, which is counted).
#[derive(Debug)]
struct ClientCert(Arc<CertifiedKey>);

impl ResolvesClientCert for ClientCert {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// "No such file" and "permission denied" as such, before a PEM error
/// would hide them.
fn readable(path: &Path) -> Result<()> {
    std::fs::File::open(path).map(drop).with_context(|| format!("cannot read {}", path.display()))
}

/// What the proxy needs of a certificate and rustls does not read.
struct Read {
    not_after: SystemTime,
    /// subjectAltName dNSName entries, lower-cased: what clients match
    /// (RFC 6125 §6.4.4: not the common name when these exist, and CAs
    /// have put every name there for years).
    dns_names: Vec<String>,
}

/// Walks RFC 5280 §4.1 with yasna doing the DER: a full X.509 parser
/// would bring its own dependency tree for two fields.
fn read_certificate(der: &[u8]) -> yasna::ASN1Result<Read> {
    use yasna::{models::ObjectIdentifier, Tag};
    let subject_alt_name = ObjectIdentifier::from_slice(&[2, 5, 29, 17]);
    yasna::parse_der(der, |r| {
        r.read_sequence(|cert| {
            let read = cert.next().read_sequence(|tbs| {
                tbs.read_optional(|r| r.read_tagged(Tag::context(0), |r| r.read_i64()))?;
                tbs.next().read_der()?; // serialNumber
                tbs.next().read_der()?; // signature
                tbs.next().read_der()?; // issuer
                let not_after = tbs.next().read_sequence(|v| {
                    read_time(v.next())?;
                    read_time(v.next())
                })?;
                tbs.next().read_der()?; // subject
                tbs.next().read_der()?; // subjectPublicKeyInfo
                let mut dns_names = Vec::new();
                // issuerUniqueID [1], subjectUniqueID [2], extensions [3].
                while let Some(field) = tbs.read_optional(|r| r.read_tagged_der())? {
                    if field.tag() != Tag::context(3) {
                        continue;
                    }
                    yasna::parse_der(field.value(), |r| {
                        r.read_sequence_of(|ext| {
                            ext.read_sequence(|ext| {
                                let id = ext.next().read_oid()?;
                                ext.read_default(false, |r| r.read_bool())?;
                                let value = ext.next().read_bytes()?;
                                if id == subject_alt_name {
                                    dns_names = read_dns_names(&value)?;
                                }
                                Ok(())
                            })
                        })
                    })?;
                }
                Ok(Read { not_after, dns_names })
            })?;
            cert.next().read_der()?; // signatureAlgorithm
            cert.next().read_der()?; // signatureValue
            Ok(read)
        })
    })
}

/// Time ::= UTCTime | GeneralizedTime
fn read_time(r: yasna::BERReader<'_, '_>) -> yasna::ASN1Result<SystemTime> {
    let t = if r.lookahead_tag()? == yasna::tags::TAG_UTCTIME {
        *r.read_utctime()?.datetime()
    } else {
        *r.read_generalized_time()?.datetime()
    };
    Ok(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(t.unix_timestamp().max(0) as u64))
}

/// GeneralNames: dNSName is `[2] IMPLICIT IA5String`; the other kinds
/// (IP addresses, URIs) are not chosen by SNI.
fn read_dns_names(der: &[u8]) -> yasna::ASN1Result<Vec<String>> {
    let mut names = Vec::new();
    yasna::parse_der(der, |r| {
        r.read_sequence_of(|name| {
            let name = name.read_tagged_der()?;
            if name.tag() == yasna::Tag::context(2) {
                if let Ok(n) = std::str::from_utf8(name.value()) {
                    names.push(n.trim_end_matches('.').to_ascii_lowercase());
                }
            }
            Ok(())
        })
    })?;
    Ok(names)
}
