//! The one bounded input path (`docs/config.md#limits`) for every file the crate reads: config
//! layers and the model manifest ([`read_text`]), traces and `fit` inputs ([`open_bounded`]).
//!
//! - only regular files: a FIFO would block for ever, a device never ends;
//! - never more than a documented number of bytes per file, nor per line, counted as the bytes
//!   arrive (a file may grow after its size was checked, a pipe has no size);
//! - UTF-8 text, line by line ([`Bounded::next_line`]) or whole ([`read_text`]);
//! - line numbers (from 1) in the errors, so a caller can name the line.
//!
//! Each caller picks its limits and names the file in its own error type.

use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;

/// The largest config layer file read, in bytes (1 MiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// The largest model manifest read, in bytes (4 MiB: room for thousands of nodes).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

/// Why an input file was not read. Displays as a reason, after the file's name.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// It does not exist or cannot be opened or read.
    #[error("cannot be read: {0}")]
    Io(#[from] std::io::Error),
    /// A FIFO, device, socket or directory.
    #[error("is not a regular file (it is a {0}); inputs must be regular files")]
    NotRegular(&'static str),
    /// Larger than the limit.
    #[error("is larger than the limit of {limit} bytes (docs/config.md#limits)")]
    TooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
    /// Not UTF-8 text.
    #[error("is not UTF-8 text (invalid byte at offset {0})")]
    NotUtf8(usize),
    /// A line longer than the limit.
    #[error("line {line} is longer than {limit} bytes")]
    LineTooLong {
        /// The line, from 1.
        line: u64,
        /// The limit, in bytes.
        limit: u64,
    },
}

impl InputError {
    /// The error a `Bounded` read returned: the limit it hit, or the plain I/O error.
    pub fn from_io(e: io::Error) -> Self {
        match e.get_ref().and_then(|inner| inner.downcast_ref::<Hit>()) {
            Some(&Hit::File { limit }) => Self::TooLarge { limit },
            Some(&Hit::Line { line, limit }) => Self::LineTooLong { line, limit },
            None => Self::Io(e),
        }
    }
}

/// The bytes a [`Bounded`] reader lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most bytes of the whole input.
    pub file_bytes: u64,
    /// The most bytes of one line (without its `\n`).
    pub line_bytes: u64,
}

/// What kind of file `meta` describes, for the refusal of one that is not regular.
fn kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "device";
        }
        if t.is_socket() {
            return "socket";
        }
    }
    "special file"
}

/// Opens `path` for reading if it is a regular file (following symlinks). The type is checked
/// before opening, since opening a FIFO blocks until a writer comes, and again on the open file
/// in case it was swapped in between.
///
/// # Errors
/// A missing or unreadable file, or one that is not regular.
pub fn open_regular(path: &Path) -> Result<File, InputError> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(InputError::NotRegular(kind(&meta)));
    }
    let file = File::open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(InputError::NotRegular(kind(&meta)));
    }
    Ok(file)
}

/// Opens the regular file at `path` for a bounded read: refused at once when its size already
/// passes `limits.file_bytes`, and again by the reader if it grows.
///
/// # Errors
/// As [`open_regular`], or a file larger than the limit.
pub fn open_bounded(path: &Path, limits: Limits) -> Result<Bounded<BufReader<File>>, InputError> {
    let file = open_regular(path)?;
    if file.metadata()?.len() > limits.file_bytes {
        return Err(InputError::TooLarge {
            limit: limits.file_bytes,
        });
    }
    Ok(Bounded::new(BufReader::new(file), limits))
}

/// Which limit a [`Bounded`] read hit, carried inside an `io::Error` (through readers such as
/// `csv` that only pass `io::Error`s on); [`InputError::from_io`] takes it out again.
#[derive(Debug)]
enum Hit {
    File { limit: u64 },
    Line { line: u64, limit: u64 },
}

impl fmt::Display for Hit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::File { limit } => write!(f, "more than {limit} bytes"),
            Self::Line { line, limit } => write!(f, "line {line} is longer than {limit} bytes"),
        }
    }
}

impl std::error::Error for Hit {}

/// A line read by [`Bounded::next_line`].
#[derive(Debug, PartialEq, Eq)]
pub enum Line<'a> {
    /// The line's text, without its `\n` (a `\r` before it is kept).
    Text(&'a str),
    /// Longer than the line limit: it was read to its end and dropped, so the caller may
    /// skip it and go on.
    TooLong,
    /// Not UTF-8 text.
    NotUtf8,
}

/// A reader that fails once more than `limits.file_bytes` went through it, or (read through
/// [`Read`]) a line passes `limits.line_bytes`: the limits hold for pipes and endless devices
/// too, where a file's size says nothing. It counts lines from 1 as it goes.
#[derive(Debug)]
pub struct Bounded<R> {
    inner: R,
    limits: Limits,
    total: u64,
    line_len: u64,
    /// The 1-based number of the line being read.
    line: u64,
    /// [`Bounded::next_line`]'s buffer.
    buf: Vec<u8>,
}

impl<R> Bounded<R> {
    /// Wraps `inner` under `limits`.
    pub fn new(inner: R, limits: Limits) -> Self {
        Self {
            inner,
            limits,
            total: 0,
            line_len: 0,
            line: 1,
            buf: Vec::new(),
        }
    }

    fn count_total(&mut self, n: usize) -> io::Result<()> {
        self.total = self.total.saturating_add(n as u64);
        if self.total > self.limits.file_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                Hit::File {
                    limit: self.limits.file_bytes,
                },
            ));
        }
        Ok(())
    }
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count_total(n)?;
        for &byte in buf.get(..n).unwrap_or(&[]) {
            if byte == b'\n' {
                self.line += 1;
                self.line_len = 0;
            } else {
                self.line_len += 1;
                if self.line_len > self.limits.line_bytes {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        Hit::Line {
                            line: self.line,
                            limit: self.limits.line_bytes,
                        },
                    ));
                }
            }
        }
        Ok(n)
    }
}

impl<R: BufRead> Bounded<R> {
    /// Reads the next line, with its number (from 1); `None` at the end. A line longer than the
    /// line limit is read to its end but not kept ([`Line::TooLong`]): only the file limit ends
    /// the read.
    ///
    /// # Errors
    /// An I/O error, or the file limit passed.
    pub fn next_line(&mut self) -> io::Result<Option<(u64, Line<'_>)>> {
        self.buf.clear();
        let (mut read_any, mut too_long) = (false, false);
        loop {
            let chunk = match self.inner.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if chunk.is_empty() {
                if !read_any {
                    return Ok(None);
                }
                break;
            }
            read_any = true;
            let (part, end) = match chunk.iter().position(|&c| c == b'\n') {
                Some(i) => (&chunk[..i], Some(i + 1)),
                None => (chunk, None),
            };
            let room = usize::try_from(self.limits.line_bytes)
                .unwrap_or(usize::MAX)
                .saturating_sub(self.buf.len());
            too_long |= part.len() > room;
            self.buf.extend_from_slice(&part[..part.len().min(room)]);
            let used = end.unwrap_or(chunk.len());
            self.inner.consume(used);
            self.count_total(used)?;
            if end.is_some() {
                break;
            }
        }
        let number = self.line;
        self.line += 1;
        let line = if too_long {
            Line::TooLong
        } else {
            match std::str::from_utf8(&self.buf) {
                Ok(text) => Line::Text(text),
                Err(_) => Line::NotUtf8,
            }
        };
        Ok(Some((number, line)))
    }
}

/// Reads the regular file at `path` as UTF-8 text of at most `limit` bytes.
///
/// # Errors
/// As [`open_regular`], a file longer than `limit`, or one that is not UTF-8.
pub fn read_text(path: &Path, limit: u64) -> Result<String, InputError> {
    let file = open_regular(path)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(InputError::TooLarge { limit });
    }
    String::from_utf8(bytes).map_err(|e| InputError::NotUtf8(e.utf8_error().valid_up_to()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_regular_file_within_the_limit_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        std::fs::write(&p, "x = 1\n").unwrap();
        assert_eq!(read_text(&p, 6).unwrap(), "x = 1\n");
        assert!(matches!(
            read_text(&p, 5),
            Err(InputError::TooLarge { limit: 5 })
        ));
        std::fs::write(&p, b"ok\xff").unwrap();
        assert_eq!(
            read_text(&p, 100).unwrap_err().to_string(),
            "is not UTF-8 text (invalid byte at offset 2)"
        );
    }

    #[test]
    fn directories_and_devices_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            read_text(dir.path(), 100).unwrap_err().to_string(),
            "is not a regular file (it is a directory); inputs must be regular files"
        );
        #[cfg(unix)]
        assert!(matches!(
            read_text(Path::new("/dev/zero"), 100),
            Err(InputError::NotRegular("device"))
        ));
    }

    const SMALL: Limits = Limits {
        file_bytes: 64,
        line_bytes: 4,
    };

    #[test]
    fn lines_are_numbered_and_a_long_one_is_dropped_not_fatal() {
        let mut r = Bounded::new(&b"ab\r\n\ntoolong\n\xff\nend"[..], SMALL);
        let mut got = Vec::new();
        while let Some((number, line)) = r.next_line().unwrap() {
            let line = match line {
                Line::Text(t) => t.to_owned(),
                other => format!("{other:?}"),
            };
            got.push((line, number));
        }
        let want = [
            ("ab\r", 1),
            ("", 2),
            ("TooLong", 3),
            ("NotUtf8", 4),
            ("end", 5),
        ];
        assert_eq!(got, want.map(|(l, n)| (l.to_owned(), n)));
    }

    #[test]
    fn a_read_stops_at_either_limit_naming_it() {
        let mut out = Vec::new();
        let e = Bounded::new(&b"ab\nabcde\n"[..], SMALL)
            .read_to_end(&mut out)
            .unwrap_err();
        let e = InputError::from_io(e);
        assert!(
            matches!(e, InputError::LineTooLong { line: 2, limit: 4 }),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "line 2 is longer than 4 bytes");
        let endless = io::repeat(b'\n');
        let e = Bounded::new(endless, SMALL)
            .read_to_end(&mut out)
            .unwrap_err();
        assert!(matches!(
            InputError::from_io(e),
            InputError::TooLarge { limit: 64 }
        ));
        let mut lines = Bounded::new(BufReader::new(io::repeat(b'\n')), SMALL);
        let e = loop {
            if let Err(e) = lines.next_line() {
                break e;
            }
        };
        assert!(matches!(
            InputError::from_io(e),
            InputError::TooLarge { limit: 64 }
        ));
    }
}
