//! The rustls connector for a connection string's TLS settings, checking
//! the server's certificate as libpq's `sslmode` says.
//!
//! - `verify-full`: the chain to a trusted root and the host name.
//! - `verify-ca`: the chain only (any name); so do `require` and `prefer`
//!   when `sslrootcert` is given, as libpq does.
//! - `require` and `prefer` without `sslrootcert`: encrypted, not checked.
//!
//! The roots are `sslrootcert` (a PEM file, or `system` for the platform's
//! store), else the Mozilla roots compiled in. `sslcert`/`sslkey` present a
//! client certificate. Files named in `~/.postgresql/` are not read unless
//! named: what the relay trusts is all in its configuration.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::dsn::{RootCert, TlsMode, TlsSettings};
use super::StoreError;

/// The connector for `settings`; reads the files it names.
pub fn connector(settings: &TlsSettings) -> Result<MakeRustlsConnect, StoreError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Tls(e.to_string()))?;
    let check = match settings.mode {
        TlsMode::VerifyFull => Check::Full,
        TlsMode::VerifyCa => Check::Chain,
        // libpq checks the chain whenever it has a root certificate.
        TlsMode::Prefer | TlsMode::Require if settings.root_cert.is_some() => Check::Chain,
        TlsMode::Disable | TlsMode::Prefer | TlsMode::Require => Check::Nothing,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match check {
        Check::Nothing => Arc::new(Unverified(provider)),
        Check::Chain | Check::Full => {
            let webpki = WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots(settings.root_cert.as_ref())?),
                provider,
            )
            .build()
            .map_err(|e| StoreError::Tls(format!("sslrootcert: {e}")))?;
            if check == Check::Full {
                webpki
            } else {
                Arc::new(AnyName(webpki))
            }
        }
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match &settings.client_cert {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = certificates("sslcert", cert)?;
            let key = PrivateKeyDer::from_pem_slice(&read("sslkey", key)?).map_err(|e| {
                StoreError::Tls(format!(
                    "sslkey {}: no private key in it ({e}); an encrypted key is not supported",
                    key.display()
                ))
            })?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| StoreError::Tls(format!("sslcert and sslkey: {e}")))?
        }
    };
    // PostgreSQL 17's direct TLS (`sslnegotiation=direct`) requires it;
    // older servers ignore it.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(MakeRustlsConnect::new(config))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    Nothing,
    Chain,
    Full,
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path)
        .map_err(|e| StoreError::Tls(format!("{key} {}: cannot be read: {e}", path.display())))
}

fn certificates(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, StoreError> {
    let pem = read(key, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| StoreError::Tls(format!("{key} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(StoreError::Tls(format!(
            "{key} {}: no PEM certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

fn roots(root_cert: Option<&RootCert>) -> Result<RootCertStore, StoreError> {
    let mut roots = RootCertStore::empty();
    match root_cert {
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Some(RootCert::File(path)) => {
            for cert in certificates("sslrootcert", path)? {
                roots
                    .add(cert)
                    .map_err(|e| StoreError::Tls(format!("sslrootcert {}: {e}", path.display())))?;
            }
        }
        Some(RootCert::System) => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default();
                return Err(StoreError::Tls(format!(
                    "sslrootcert=system: no CA certificate found in the platform's store (install ca-certificates, or set SSL_CERT_FILE){why}"
                )));
            }
        }
    }
    Ok(roots)
}

/// `require` and `prefer` without a root certificate: the session is
/// encrypted and the handshake's signatures are checked, the certificate is
/// not (libpq's behaviour; it protects against eavesdropping, not against a
/// server in the middle).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain is checked as for `verify-full`; only the error
/// that the certificate names another host is let through.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// What a certificate error of the handshake means for the settings, when
/// rustls's words need it ("UnknownIssuer").
pub(crate) fn explain(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cause = Some(e);
    while let Some(c) = cause {
        let rustls = c
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .or_else(|| c.downcast_ref::<rustls::Error>());
        if let Some(rustls::Error::InvalidCertificate(cert)) = rustls {
            return Some(match cert {
                CertificateError::UnknownIssuer => "the server's certificate is signed by no CA that sslrootcert names; without sslrootcert the public web roots compiled in are trusted, with sslrootcert=system the platform's".to_owned(),
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => "sslmode=verify-full checks that the certificate names the host connected to; use the name it was issued for, or sslmode=verify-ca".to_owned(),
                _ => "the server's certificate was refused".to_owned(),
            });
        }
        cause = c.source();
    }
    None
}
