//! A network cut for one process, where the machine has no firewall to give one: loaded with
//! `LD_PRELOAD`, this library stands in for libc's `connect` and refuses (`EHOSTUNREACH`, as a
//! router that lost its route answers) every new connection to an address the file named by
//! `UNDERSTUDY_CUT_FILE` lists, one per line: `127.0.1.0/24` or `127.0.0.1:6443`. The file is read
//! at every connect, so a test cuts and heals by writing and removing it; without the file, or the
//! variable, every connection goes through. Connections already open are not touched: what is cut
//! must be reached on fresh connections (the operator's calls to pods are), or through a relay the
//! test closes.
//!
//! It is test tooling, loaded only into processes the regional cluster suite starts.

use std::net::Ipv4Addr;

use libc::{c_int, sockaddr, sockaddr_in, socklen_t};

type Connect = unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int;

/// libc's `connect`, unless the address is cut.
///
/// # Safety
///
/// As libc's `connect`: `address` points to `length` readable bytes of a socket address.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, address: *const sockaddr, length: socklen_t) -> c_int {
    // SAFETY: the caller gives a socket address of `length` bytes, as libc's connect requires.
    if let Some((ip, port)) = unsafe { ipv4(address, length) }
        && is_cut(ip, port)
    {
        // SAFETY: errno is this thread's, and always writable.
        unsafe { *libc::__errno_location() = libc::EHOSTUNREACH };
        return -1;
    }
    // SAFETY: RTLD_NEXT finds the next `connect` in load order, libc's, whose signature this is.
    unsafe {
        let next = libc::dlsym(libc::RTLD_NEXT, c"connect".as_ptr());
        if next.is_null() {
            *libc::__errno_location() = libc::ENOSYS;
            return -1;
        }
        let next: Connect = std::mem::transmute::<*mut libc::c_void, Connect>(next);
        next(fd, address, length)
    }
}

/// The IPv4 address and port of `address`, when it is one.
///
/// # Safety
///
/// `address` points to `length` readable bytes.
unsafe fn ipv4(address: *const sockaddr, length: socklen_t) -> Option<(Ipv4Addr, u16)> {
    if address.is_null() || (length as usize) < std::mem::size_of::<sockaddr_in>() {
        return None;
    }
    // SAFETY: non-null, and long enough for a sockaddr_in, whose family comes first.
    let family = unsafe { (*address).sa_family };
    if c_int::from(family) != libc::AF_INET {
        return None;
    }
    // SAFETY: an AF_INET address of sockaddr_in's size is a sockaddr_in.
    let inet = unsafe { std::ptr::read_unaligned(address.cast::<sockaddr_in>()) };
    Some((
        Ipv4Addr::from(u32::from_be(inet.sin_addr.s_addr)),
        u16::from_be(inet.sin_port),
    ))
}

fn is_cut(ip: Ipv4Addr, port: u16) -> bool {
    let Some(file) = std::env::var_os("UNDERSTUDY_CUT_FILE") else {
        return false;
    };
    let Ok(text) = std::fs::read_to_string(file) else {
        return false;
    };
    text.lines().any(|line| matches(line.trim(), ip, port))
}

/// Whether `rule` (`a.b.c.d/len` or `a.b.c.d:port`) covers `ip:port`.
fn matches(rule: &str, ip: Ipv4Addr, port: u16) -> bool {
    if let Some((network, bits)) = rule.split_once('/') {
        let (Ok(network), Ok(bits)) = (network.parse::<Ipv4Addr>(), bits.parse::<u32>()) else {
            return false;
        };
        let mask = u32::MAX.checked_shl(32 - bits.min(32)).unwrap_or(0);
        return u32::from(ip) & mask == u32::from(network) & mask;
    }
    if let Some((host, rule_port)) = rule.split_once(':') {
        return host.parse::<Ipv4Addr>() == Ok(ip) && rule_port.parse::<u16>() == Ok(port);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_is_a_network_or_an_address_and_port() {
        let ip = Ipv4Addr::new(127, 0, 1, 12);
        assert!(matches("127.0.1.0/24", ip, 8001));
        assert!(!matches("127.0.2.0/24", ip, 8001));
        assert!(matches("127.0.1.12:8001", ip, 8001));
        assert!(!matches("127.0.1.12:8000", ip, 8001));
        assert!(matches("0.0.0.0/0", ip, 1));
        assert!(!matches("nonsense", ip, 1));
    }
}
