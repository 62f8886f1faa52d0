//! File-per-key backend, the layout of nginx's proxy_cache: each record is
//! one file `data/X/YZ/<32 hex digits of the id>` (levels 1:2, 4096
//! directories). A write goes to `tmp/`, is fsynced when configured, and is
//! renamed into place: rename is atomic, so a reader or a restart sees the
//! old file or the new one. Temporary files a crash leaves are removed at
//! open.
//!
//! Startup stats every file (size, mtime) without opening it, so it costs
//! one directory walk; `for_each_meta` has to read each file's head.

use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use anyhow::{Context, Result};

use bytes::Bytes;

use crate::cache::{Backend, ScanItem};
use crate::record::{self, Raw};
use crate::{BackendKind, ChunkSource, Config, Meta, NoWait, CHUNK_BYTES, STREAM_THRESHOLD};

/// The rest of a record file, read from its open descriptor: a rename or
/// delete of the path meanwhile does not change what it reads.
struct FileChunks {
    file: File,
}

impl ChunkSource for FileChunks {
    fn next_chunk(&mut self) -> Result<Option<Bytes>> {
        let mut buf = vec![0; CHUNK_BYTES];
        let n = loop {
            match self.file.read(&mut buf) {
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        buf.truncate(n);
        Ok((n > 0).then(|| buf.into()))
    }
}

pub(crate) struct Files {
    data: PathBuf,
    tmp: PathBuf,
    fsync: bool,
    seq: AtomicU64,
}

fn not_found<T>(r: std::io::Result<T>) -> std::io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

impl Files {
    pub(crate) fn open(dir: &Path, config: &Config) -> Result<Files> {
        let (data, tmp) = (dir.join("data"), dir.join("tmp"));
        fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
        if let Some(rd) = not_found(fs::read_dir(&tmp))? {
            for e in rd {
                fs::remove_file(e?.path())?;
            }
        }
        fs::create_dir_all(&tmp)?;
        Ok(Files { data, tmp, fsync: config.fsync, seq: AtomicU64::new(0) })
    }

    fn path(&self, id: u128) -> PathBuf {
        let hex = format!("{id:032x}");
        self.data.join(&hex[..1]).join(&hex[1..3]).join(hex)
    }

    /// Every record file with its id, in directory order.
    fn walk(&self, f: &mut dyn FnMut(u128, &Path) -> Result<()>) -> Result<()> {
        for l1 in fs::read_dir(&self.data)? {
            for l2 in fs::read_dir(l1?.path())? {
                for file in fs::read_dir(l2?.path())? {
                    let file = file?;
                    let name = file.file_name();
                    let Some(id) = name.to_str().and_then(|n| u128::from_str_radix(n, 16).ok()) else { continue };
                    f(id, &file.path())?;
                }
            }
        }
        Ok(())
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Backend for Files {
    const KIND: BackendKind = BackendKind::Files;
    const READS_BLOCK: bool = true;
    const WRITES_BLOCK: bool = true;

    fn get(&self, id: u128) -> Result<Option<Raw>> {
        let Some(mut file) = not_found(File::open(self.path(id)))? else { return Ok(None) };
        let total = file.metadata()?.len();
        if total <= STREAM_THRESHOLD + 64 * 1024 {
            let mut rec = Vec::with_capacity(total as usize);
            file.read_to_end(&mut rec)?;
            return Ok(Some(Raw::Whole(rec.into())));
        }
        // The head says how long key and header are; they come with it.
        let mut prefix = vec![0; record::HEAD];
        if file.read_exact(&mut prefix).is_err() {
            return Ok(Some(Raw::Corrupt));
        }
        let Some((_, k, h, _)) = record::head(&prefix, total) else { return Ok(Some(Raw::Corrupt)) };
        prefix.resize(record::HEAD + k + h, 0);
        if file.read_exact(&mut prefix[record::HEAD..]).is_err() {
            return Ok(Some(Raw::Corrupt));
        }
        Ok(Some(Raw::Split { prefix: prefix.into(), total, rest: Box::new(FileChunks { file }) }))
    }

    /// A record read whole from the page cache with `preadv2(RWF_NOWAIT)`,
    /// which fails with EAGAIN instead of waiting for the disk, so a hit
    /// on a hot file costs no hop to a thread pool (nginx reads the same
    /// way before it hands a read to its thread pool). The `open` is
    /// made here too: the index says the file exists, and its directory
    /// entries are as hot as the file. A record streamed in chunks, or
    /// one only partly in the page cache, waits.
    fn get_nowait(&self, id: u128) -> Result<NoWait<Option<Raw>>> {
        let Some(file) = not_found(File::open(self.path(id)))? else { return Ok(NoWait::Ready(None)) };
        let total = file.metadata()?.len();
        if total > STREAM_THRESHOLD + 64 * 1024 {
            return Ok(NoWait::WouldBlock);
        }
        let mut rec = vec![0u8; total as usize];
        let iov = libc::iovec { iov_base: rec.as_mut_ptr().cast(), iov_len: rec.len() };
        // SAFETY: one iovec over `rec`, which outlives the call; the file
        // descriptor is open.
        let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EOPNOTSUPP) => Ok(NoWait::WouldBlock),
                _ => Err(e.into()),
            };
        }
        if n as u64 != total {
            return Ok(NoWait::WouldBlock);
        }
        Ok(NoWait::Ready(Some(Raw::Whole(rec.into()))))
    }

    fn put(&self, id: u128, rec: &[u8], _meta: &[u8]) -> Result<()> {
        let tmp = self.tmp.join(format!("{id:032x}.{}.{}", std::process::id(), self.seq.fetch_add(1, Ordering::Relaxed)));
        let mut f = File::create(&tmp)?;
        f.write_all(rec)?;
        if self.fsync {
            f.sync_data()?;
        }
        drop(f);
        let path = self.path(id);
        if let Err(e) = fs::rename(&tmp, &path) {
            if e.kind() != ErrorKind::NotFound {
                return Err(e.into());
            }
            fs::create_dir_all(path.parent().unwrap())?;
            fs::rename(&tmp, &path)?;
        }
        if self.fsync {
            sync_dir(path.parent().unwrap())?;
        }
        Ok(())
    }

    fn remove(&self, id: u128) -> Result<bool> {
        Ok(not_found(fs::remove_file(self.path(id)))?.is_some())
    }

    fn scan(&self, f: &mut dyn FnMut(u128, Option<ScanItem>)) -> Result<()> {
        self.walk(&mut |id, path| {
            let Some(md) = not_found(fs::metadata(path))? else { return Ok(()) };
            let order = md.modified()?.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
            let item = (md.len() >= record::HEAD as u64).then_some(ScanItem { size: md.len(), expires_at_ms: u64::MAX, order });
            f(id, item);
            Ok(())
        })
    }

    fn for_each_meta(&self, f: &mut dyn FnMut(&[u8], &Meta)) -> Result<()> {
        let mut buf = vec![0; record::HEAD];
        self.walk(&mut |_, path| {
            let Some(mut file) = not_found(File::open(path))? else { return Ok(()) };
            let len = file.metadata()?.len();
            buf.resize(record::HEAD, 0);
            if file.read_exact(&mut buf).is_err() {
                return Ok(());
            }
            let Some((meta, k, _, _)) = record::head(&buf, len) else { return Ok(()) };
            buf.resize(record::HEAD + k, 0);
            if file.read_exact(&mut buf[record::HEAD..]).is_ok() {
                f(&buf[record::HEAD..], &meta);
            }
            Ok(())
        })
    }

    fn flush(&self) -> Result<()> {
        // Writes since the last flush may be in any of 4096 directories;
        // syncing the filesystem is one call instead of tracking them.
        let dir = File::open(&self.data)?;
        if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }
}
